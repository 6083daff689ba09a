"""Reading the model's reply, pure: the payloads in its text, what only quotes, what a step does next, the built-in submit_result."""
