"""verl's experimental namespace at verl's import path: ``verl.experimental.agent_loop`` (multi-turn, tool-calling
rollouts), so an agent loop written against verl imports unchanged."""
