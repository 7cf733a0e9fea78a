"""What the package ships besides code: the model pairs, the SmolLM2 demo target, prompts, padding, tiny fixtures."""
