"""The server side: run table, runs and their lifecycle, schedule, runner, isolation of
bad samples, Prepare stages and the DALI glue."""
