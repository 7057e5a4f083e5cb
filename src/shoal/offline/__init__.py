"""Offline batches from files: request lines in (`requests`), result lines out in input or
completion order with resume (`output`), and the OpenAI batch format (`openai_batch`)."""
