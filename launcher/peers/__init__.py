"""What agents send each other directly: the bulk stream (``stream``), the checks on
what a peer may make this node write (``peer_files``), and replica transfers for a
restore (``transfer``); migration (``jitrun.migration``) uses the first two."""
