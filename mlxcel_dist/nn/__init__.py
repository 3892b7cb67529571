"""Neural-network building blocks the model families share: attention, blocks,
layers, masks, RoPE, experts, DeltaNet, quantization and LoRA adapters."""
