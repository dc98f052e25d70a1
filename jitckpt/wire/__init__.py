"""What the launcher and the workers share, byte for byte: the environment contract
(``contract``) and the worker's view of it (``config``), the job token's sealing
(``auth``), the report stream (``report``) and the checkpoint directory's layout
(``layout``). Nothing here imports the runtime: the agent imports these without
torch's training side."""
