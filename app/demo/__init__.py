"""The generated demo: a small base model, its tokenizer and catchphrase adapters (`python -m app.demo`)."""
