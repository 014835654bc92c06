"""Running one rank: assembling its stage, the step loop, the replicas' agreement checks, and the whole run from
joining the process group to the last checkpoint."""
