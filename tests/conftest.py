from hypothesis import settings

# CI has 2 slow cores: judge hypothesis tests on their examples, not on wall time.
settings.register_profile("afd", deadline=None, max_examples=200)
settings.load_profile("afd")
