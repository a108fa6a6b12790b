"""Live advice: today's traffic against the stored evidence, judged while the service runs."""
