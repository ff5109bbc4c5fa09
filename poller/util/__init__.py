"""Small helpers every layer may use: log set-up and wording, backoff, the one-pass
messages of validation errors, URL redaction. No I/O of their own, no settings."""
