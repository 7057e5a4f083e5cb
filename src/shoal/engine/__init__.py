"""The step loop: requests in, plans to the runner, outputs out."""
