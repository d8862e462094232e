"""One DP rank as parts: the worker (`worker.RankWorker`) holding its model, groups, expert slots and step."""
