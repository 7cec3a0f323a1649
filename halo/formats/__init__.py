"""Model file formats: llama2.c checkpoints/tokenizers and Hugging Face Llama directories."""
