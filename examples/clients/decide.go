// Ask ratewall before a costly job, then settle what it cost (net/http only), with
// `RATEWALL_DECIDE_TOKEN=... go run decide.go org:42`. The rule "imports" settles (charge
// or cost_header in limits.toml): an allowed answer carries a reservation to settle.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"time"
)

// base is [decide] listen.
const base = "http://127.0.0.1:8081"

// call POSTs body as JSON and decodes the answer into out; a 4xx names what is wrong.
func call(path string, body, out any) {
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, base+path, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+os.Getenv("RATEWALL_DECIDE_TOKEN"))
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err == nil {
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			err = json.NewDecoder(resp.Body).Decode(out)
		} else {
			var p struct{ Detail string }
			json.NewDecoder(resp.Body).Decode(&p)
			err = fmt.Errorf("%s: %s", resp.Status, p.Detail)
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
		os.Exit(2)
	}
}

func main() {
	key := append(os.Args[1:], "org:42")[0] // the first argument, or org:42
	var d struct {
		Allowed     bool
		RetryAfter  int64  `json:"retry_after"` // null (0 here) when allowed
		RateLimit   string `json:"ratelimit"`
		Reservation string
	}
	call("/v1/decide", map[string]any{"rule": "imports", "key": key, "cost": 10}, &d)
	if !d.Allowed {
		fmt.Printf("limited: try again in %d s (%s)\n", d.RetryAfter, d.RateLimit)
		os.Exit(1)
	}
	used := 3 // the job itself: here, pretend it used 3 of the 10 units asked for
	if d.Reservation != "" {
		call("/v1/settle", map[string]any{"reservation": d.Reservation, "cost": used}, &map[string]any{})
	}
	fmt.Printf("done: %d units (%s)\n", used, d.RateLimit)
}
