"""What users run to start verl-hpc: set-up and quickstart scripts and thin launch entry points.

- `bash launch/setup_env.sh`, `bash launch/quickstart.sh`: README commands
- `python -m launch.quickstart`: the data -> SFT -> GRPO driver behind quickstart.sh
- `python -m launch.selftest`: a tiny real distributed job used by the tests and the sbatch templates

The machinery (rank discovery, rendezvous, spawning, preemption) lives in `verl.launcher`; this
package imports only verl's public entry points.
"""
