"""deep_ep: expert-parallel (MoE) dispatch/combine communication for PyTorch."""
