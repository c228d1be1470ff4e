"""Training DSPARK drafters for a target model: the data (prompts, continuations the engine
generates, the target's teacher-forced hidden states), the training objective and loop, and
the command lines ``python -m unimem.training.train_drafter`` (a drafter for a real
checkpoint, trained on the engine's own outputs) and ``python -m unimem.training.distill``
(distillation on greedy rollouts). Serving never imports this package."""
