"""SFT and preference data, Hugging Face `datasets` inputs, batching, the tokenizer and the embedded tasks."""
