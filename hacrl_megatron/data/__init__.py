"""data stage of hacrl_megatron."""
