"""Online serving: an OpenAI-compatible HTTP front end over running engine replicas (`afd serve`)."""
