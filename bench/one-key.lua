-- wrk: every request with the same API key (the abuse run: one key far past its limit).
wrk.headers["x-api-key"] = "abuser"
