"""Running recipes on Ray clusters: job submission (`submit`) and resource placement (`placement`)."""
