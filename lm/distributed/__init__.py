"""Process groups and the engines that apply parallelism to a model from outside (DDP, FSDP2, DeepSpeed)."""
