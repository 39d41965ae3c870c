"""Training data: datasets and prompts (`prompts`), streaming (`stream`), images in the prompt (`vision`)."""
