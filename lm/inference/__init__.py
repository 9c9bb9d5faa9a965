"""Using a trained model: scoring it on text, and turning prompts into its inputs and its outputs into text."""
