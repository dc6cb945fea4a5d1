"""Pre-flight checks a launch runs before any GPU is asked for: the GPU layout, the memory and disk estimate, the
model, retriever and async-mode checks, and the relaunch rule after a stop."""
