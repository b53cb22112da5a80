"""SGLang on CPU: our custom weight loader, the stub sgl_kernel and the torchvision op shim
(installed by launch/setup_sglang.sh)."""
