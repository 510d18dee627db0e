"""trainer stage of hacrl_megatron."""
