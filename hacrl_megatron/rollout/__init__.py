"""rollout stage of hacrl_megatron."""
