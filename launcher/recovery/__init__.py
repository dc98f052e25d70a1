"""The failure episode of one agent, as small steps: report intake
(``reports``), stopping and saving (``episode``), the restore choice and the
job-wide decision (``restore``), the timeline's recovery record (``record``)."""
