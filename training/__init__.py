"""What a training run calls beside its own loop: the optimizers, lr schedules and the NaN guard on every step
(optim), LoRA adapters (lora), checkpoints and the resume policy (checkpoint), device, precision and compile
(runtime), signals and a lost peer (faults), metrics.jsonl and wandb (tracking)."""
