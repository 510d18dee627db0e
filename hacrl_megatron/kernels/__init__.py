"""kernels stage of hacrl_megatron."""
