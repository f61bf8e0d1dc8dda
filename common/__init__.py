"""Infrastructure shared by grpo.py, ppo.py and dpo.py. Nothing here is algorithm logic."""
