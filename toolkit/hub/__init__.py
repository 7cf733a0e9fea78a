"""Publishing: Hub push, model cards and the Space export."""
