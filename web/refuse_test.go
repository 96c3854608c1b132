package web_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/web"
)

// send sends a request with the given Host and headers, following no
// redirect, and returns the response with its body read.
func send(t *testing.T, method, u, host string, header map[string]string, form url.Values) (*http.Response, string) {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if host != "" {
		req.Host = host
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res, string(b)
}

// do sends a request with the given Host and headers and returns the
// status and body.
func do(t *testing.T, method, u, host string, header map[string]string, form url.Values) (int, string) {
	t.Helper()
	res, body := send(t, method, u, host, header, form)
	return res.StatusCode, body
}

// The page refuses what it must: a Host it is not served under (DNS
// rebinding: a name of the attacker's resolving to 127.0.0.1), a POST
// whose only cross-site signal is a foreign Referer, parameters that are
// not text, and static paths that are not files; and it still serves
// localhost, IP addresses and the names configured.
func TestPageRefusesWhatItMust(t *testing.T) {
	t.Parallel()
	rg := newRig(t, web.Config{AllowActions: true, Hosts: []string{"status.example.com"}})
	port := rg.srv.URL[strings.LastIndex(rg.srv.URL, ":"):]
	for _, tc := range []struct {
		host string
		want int
	}{
		{"rebind.attacker.example" + port, http.StatusMisdirectedRequest},
		{"rebind.attacker.example", http.StatusMisdirectedRequest},
		{"localhost" + port, http.StatusOK},
		{"127.0.0.1" + port, http.StatusOK},
		{"[::1]" + port, http.StatusOK},
		{"Status.Example.COM." + port, http.StatusOK},
	} {
		if code, body := do(t, http.MethodGet, rg.srv.URL+"/api/leases", tc.host, nil, nil); code != tc.want {
			t.Errorf("GET with Host %q: %d, want %d\n%s", tc.host, code, tc.want, body)
		}
	}
	// A rebinding page cannot steer either: the POST is refused before it
	// reaches the action.
	if code, _ := do(t, http.MethodPost, rg.srv.URL+"/pause", "rebind.attacker.example"+port, nil, url.Values{"job": {"tick"}}); code != http.StatusMisdirectedRequest {
		t.Errorf("POST /pause with a foreign Host: %d, want 421", code)
	}

	// A POST with a foreign Referer and neither Origin nor Sec-Fetch-Site.
	form := url.Values{"job": {"tick"}}
	if code, body := do(t, http.MethodPost, rg.srv.URL+"/pause", "", map[string]string{"Referer": "http://evil.example/page"}, form); code != http.StatusForbidden {
		t.Errorf("POST /pause with a foreign Referer: %d, want 403\n%s", code, body)
	}
	// The same POST from the page itself is not refused for its Referer.
	if code, body := do(t, http.MethodPost, rg.srv.URL+"/resume", "", map[string]string{"Referer": rg.srv.URL + "/jobs"}, form); code == http.StatusForbidden {
		t.Errorf("POST /resume with the page's own Referer: 403\n%s", body)
	}

	// Parameters that are not text, or do not decode: 400 naming the
	// parameter, not the database's error as a 500; as JSON from the API.
	for _, q := range []string{"/api/runs?job=%00", "/jobs?job=%ff%fe", "/api/groups?group=a%00b",
		"/api/runs?limit=5&job=%zz", "/jobs?x=1&job=%zz"} {
		code, body := do(t, http.MethodGet, rg.srv.URL+q, "", nil, nil)
		name := "job"
		if strings.Contains(q, "group=") {
			name = "group"
		}
		if code != http.StatusBadRequest || !strings.Contains(body, `"`+name+`"`) {
			t.Errorf("GET %s: %d %q, want 400 naming %q", q, code, body, name)
		}
		if strings.HasPrefix(q, "/api/") {
			var v struct{ Error, Parameter string }
			if err := json.Unmarshal([]byte(body), &v); err != nil || v.Parameter != name || v.Error == "" {
				t.Errorf("GET %s: %q, want JSON with error and parameter %q", q, body, name)
			}
		}
	}

	// Static paths: files only.
	for _, tc := range []struct {
		path string
		want int
	}{{"/static/%ff", 404}, {"/static/", 404}, {"/static/nope.js", 404}, {"/static/app.js", 200}} {
		if code, _ := do(t, http.MethodGet, rg.srv.URL+tc.path, "", nil, nil); code != tc.want {
			t.Errorf("GET %s: %d, want %d", tc.path, code, tc.want)
		}
	}
}
