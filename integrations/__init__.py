"""ringserve inside other frameworks' own code: `ringserve.integrations.tunix.RingserveRollout`,
a Tunix rollout engine. Each module imports its framework; nothing else imports them."""
