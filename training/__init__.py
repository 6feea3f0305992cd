"""What a training run calls beside its step: the optimizers and lr schedules (optim), LoRA adapters (lora),
checkpoints and the resume policy (checkpoint), device, precision and compile (runtime), the NaN guard and
signals (faults), metrics.jsonl and wandb (tracking)."""
