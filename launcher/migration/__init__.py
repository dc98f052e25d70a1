"""Moving live workers with CRIU: the agent's side of ``jitrun migrate``
(``outbound``); the protocol, the image stream and the target live in
launcher/migrate.py, launcher/migrate_agent.py and launcher/criu.py."""
