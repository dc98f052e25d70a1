"""Moving live workers with CRIU: the agent's side of ``jitrun migrate``
(``outbound``); the protocol, the image stream and the target live in
launcher/migration/control.py, launcher/migration/agents.py and launcher/migration/criu.py."""
