package web

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"path"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

//go:embed assets
var assets embed.FS

// Errors New returns.
var (
	// ErrNilPool is returned by New for a nil pool.
	ErrNilPool = errors.New("web: nil pool")
	// ErrInvalidConfig is wrapped by New's errors for a bad Config field.
	ErrInvalidConfig = errors.New("web: invalid config")
)

// MinRefresh is the shortest Config.Refresh.
const MinRefresh = 200 * time.Millisecond

// Config configures the status page. The zero value serves read-only pages
// that update every second.
type Config struct {
	// Schema is the schema of the leases and jobs shown, "" for "pgfence".
	Schema string
	// Hosts are the host names (without port) the page is served under,
	// besides localhost and IP addresses, which are always accepted. A
	// request naming any other Host is refused (421): a page on a
	// developer's machine cannot be read, or steered, by a web page whose
	// own name an attacker has pointed at 127.0.0.1 (DNS rebinding). An
	// application serving the page under its domain lists that domain
	// here. Default: none.
	Hosts []string
	// AllowActions shows and accepts the actions: force release, run now,
	// pause and resume. Off by default: the buttons are absent and every
	// POST is refused with 403.
	AllowActions bool
	// Identity names who makes a request (the application's user, from
	// its session or a header its proxy sets), for the log line of each
	// action and the ledger's requested_by; "" for nobody known. The
	// remote address is logged either way. Default: nobody known.
	Identity func(*http.Request) string
	// Logger receives one line per action. Default slog.Default().
	Logger *slog.Logger
	// Refresh is how often an open page updates itself. Default 1s; at
	// least MinRefresh.
	Refresh time.Duration
	// Attempts is how many recent attempts the jobs page lists. Default 30.
	Attempts int
}

// Handler serves the status page and its JSON endpoints; see the package
// documentation. It holds no goroutine of its own: each request reads the
// database through the pool.
type Handler struct {
	pool   *pgxpool.Pool
	schema string
	cfg    Config
	log    *slog.Logger
	pages  map[string]*template.Template
	root   http.Handler
	hosts  map[string]bool // the names it serves under, besides IP addresses
}

// New returns the status page of the leases and jobs in cfg.Schema, read
// (and, with AllowActions, steered) through pool. It needs no lease client:
// a process that holds no lease can serve it. Mount it under a path of its
// own; it links relative to that path:
//
//	mux.Handle("/pgfence/", http.StripPrefix("/pgfence", h))
func New(pool *pgxpool.Pool, cfg Config) (*Handler, error) {
	if pool == nil {
		return nil, ErrNilPool
	}
	if cfg.Refresh == 0 {
		cfg.Refresh = time.Second
	}
	if cfg.Attempts == 0 {
		cfg.Attempts = 30
	}
	switch {
	case cfg.Refresh < MinRefresh:
		return nil, fmt.Errorf("%w: Refresh %v is below %v", ErrInvalidConfig, cfg.Refresh, MinRefresh)
	case cfg.Attempts < 1 || cfg.Attempts > 1000:
		return nil, fmt.Errorf("%w: Attempts %d is not within 1..1000", ErrInvalidConfig, cfg.Attempts)
	}
	if err := ident.ValidateSchema(cfg.Schema); err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	h := &Handler{pool: pool, schema: ident.Schema(cfg.Schema), cfg: cfg, log: cfg.Logger}
	if h.log == nil {
		h.log = slog.Default()
	}
	pages, err := parsePages()
	if err != nil {
		return nil, err
	}
	h.pages = pages

	mux := http.NewServeMux()
	static, _ := fs.Sub(assets, "assets/static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", staticFiles(static)))
	mux.HandleFunc("GET /{$}", h.page("leases", h.leases))
	mux.HandleFunc("GET /jobs", h.page("jobs", h.jobs))
	mux.HandleFunc("GET /fleet", h.page("fleet", h.fleet))
	mux.HandleFunc("GET /job", h.page("job", h.job))
	mux.HandleFunc("GET /group", h.page("group", h.group))
	mux.HandleFunc("POST /seek", h.action(h.seek))
	mux.HandleFunc("GET /release", h.action(h.confirmRelease))
	mux.HandleFunc("POST /release", h.action(h.release))
	mux.HandleFunc("POST /run", h.action(h.runNow))
	mux.HandleFunc("POST /pause", h.action(h.pause))
	mux.HandleFunc("POST /resume", h.action(h.pause))
	mux.HandleFunc("GET /api/leases", h.api(func(ctx context.Context, r *http.Request) (any, error) {
		return orEmpty(lock.Leases(ctx, h.pool, h.schema))
	}))
	mux.HandleFunc("GET /api/jobs", h.api(func(ctx context.Context, r *http.Request) (any, error) {
		return orEmpty(runner.Jobs(ctx, h.pool, h.schema, r.FormValue("job")))
	}))
	mux.HandleFunc("GET /api/runs", h.api(h.apiRuns))
	mux.HandleFunc("GET /api/fleet", h.api(func(ctx context.Context, r *http.Request) (any, error) {
		return h.readFleet(ctx)
	}))
	mux.HandleFunc("GET /api/groups", h.api(func(ctx context.Context, r *http.Request) (any, error) {
		return orEmpty(runner.Partitions(ctx, h.pool, h.schema, r.FormValue("group")))
	}))
	mux.HandleFunc("GET /api/terms", h.api(func(ctx context.Context, r *http.Request) (any, error) {
		f := runner.TermFilter{Job: r.FormValue("job"), Group: r.FormValue("group")}
		if f.Job != "" && f.Group != "" {
			return nil, fmt.Errorf("%w: job %q and group %q: give one of them", errBadRequest, f.Job, f.Group)
		}
		return orEmpty(runner.Terms(ctx, h.pool, h.schema, f))
	}))
	mux.HandleFunc("GET /api/epoch", h.api(func(ctx context.Context, r *http.Request) (any, error) {
		return h.epoch(ctx)
	}))
	// The page's own health: the database answers (a ping, 2 s at most).
	mux.Handle("GET /healthz", lock.HealthHandler(func(ctx context.Context) error {
		if err := h.pool.Ping(ctx); err != nil {
			return fmt.Errorf("the database does not answer: %w", err)
		}
		return nil
	}, 2*time.Second))
	h.root = http.NewCrossOriginProtection().Handler(mux)
	h.hosts = map[string]bool{"localhost": true}
	for _, name := range cfg.Hosts {
		h.hosts[strings.ToLower(strings.TrimSuffix(name, "."))] = true
	}
	return h, nil
}

// hostAllowed reports whether a request's Host is one the page serves:
// localhost, an IP address (a rebinding attack names a host of its own),
// or one of Config.Hosts.
func (h *Handler) hostAllowed(hostport string) bool {
	host := hostport
	if hh, _, err := net.SplitHostPort(hostport); err == nil {
		host = hh
	}
	host = strings.ToLower(strings.TrimSuffix(strings.Trim(host, "[]"), "."))
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	return h.hosts[host]
}

// foreignReferer reports a POST that carries neither Origin nor
// Sec-Fetch-Site (which http.CrossOriginProtection judges) but a Referer
// from another host: an older browser's cross-site form.
func foreignReferer(r *http.Request) bool {
	if r.Method != http.MethodPost || r.Header.Get("Origin") != "" || r.Header.Get("Sec-Fetch-Site") != "" {
		return false
	}
	ref := r.Header.Get("Referer")
	if ref == "" {
		return false
	}
	u, err := url.Parse(ref)
	return err != nil || !strings.EqualFold(u.Host, r.Host)
}

// badParameter names the first query or form parameter that is not text
// (invalid UTF-8, or a NUL, which PostgreSQL refuses in text).
func badParameter(r *http.Request) (string, bool) {
	if err := r.ParseForm(); err != nil {
		return undecodable(r.URL.RawQuery), true
	}
	for name, values := range r.Form {
		if !utf8.ValidString(name) || strings.ContainsRune(name, 0) {
			return printable.String(name), true
		}
		for _, v := range values {
			if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
				return name, true
			}
		}
	}
	return "", false
}

// undecodable names the first parameter of a raw query that does not
// decode (a bad % escape), as text; "the query" or "the form" (a request
// body that does not parse) when none does.
func undecodable(raw string) string {
	for _, pair := range strings.Split(raw, "&") {
		key, value, _ := strings.Cut(pair, "=")
		k, err := url.QueryUnescape(key)
		if err != nil {
			return printable.String(key)
		}
		if _, err := url.QueryUnescape(value); err != nil {
			return printable.String(k)
		}
	}
	if raw == "" {
		return "the form"
	}
	return "the query"
}

// staticFiles serves the embedded assets: files only (no directory
// listing), and a 404 for a path that is not one.
func staticFiles(fsys fs.FS) http.Handler {
	files := http.FileServerFS(fsys)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := r.URL.Path
		if name == "" || strings.HasSuffix(name, "/") || !utf8.ValidString(name) || !fs.ValidPath(name) {
			http.NotFound(w, r)
			return
		}
		if st, err := fs.Stat(fsys, name); err != nil || st.IsDir() {
			http.NotFound(w, r)
			return
		}
		files.ServeHTTP(w, r)
	})
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "+
		"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("X-Frame-Options", "DENY")
	if !h.hostAllowed(r.Host) {
		http.Error(w, "pgfence web: this page is not served under the name "+strconv.Quote(r.Host)+
			" (web.Config.Hosts, or pgfence ui --host, lists the names it answers to)", http.StatusMisdirectedRequest)
		return
	}
	if foreignReferer(r) {
		http.Error(w, "pgfence web: cross-origin request refused (its Referer names another site)", http.StatusForbidden)
		return
	}
	if name, bad := badParameter(r); bad {
		msg := "pgfence web: parameter " + strconv.Quote(name) + " is not valid text"
		if strings.HasPrefix(r.URL.Path, "/api/") {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": msg, "parameter": name})
			return
		}
		http.Error(w, msg, http.StatusBadRequest)
		return
	}
	if r.URL.Path == "" {
		// Mounted with StripPrefix and asked for the prefix without its
		// slash: the pages link relative to the prefix's slash.
		u, err := url.ParseRequestURI(r.RequestURI)
		if err != nil || u.Path == "" {
			http.NotFound(w, r)
			return
		}
		hd.Set("Location", path.Base(u.Path)+"/")
		w.WriteHeader(http.StatusMovedPermanently)
		return
	}
	if !strings.HasPrefix(r.URL.Path, "/static/") {
		hd.Set("Cache-Control", "no-store")
	}
	ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
	defer cancel()
	h.root.ServeHTTP(w, r.WithContext(ctx))
}

// requestTimeout bounds each request's database work (the package
// documentation): one whose database stops answering (a partition) fails,
// and an open page says it is not updating, instead of waiting for TCP to
// give up. A force release waits at most releaseTimeout within it.
const requestTimeout = 15 * time.Second

// view is what every page template gets.
type view struct {
	Page    string
	Title   string
	Schema  string
	Refresh int64 // milliseconds
	Actions bool
	Now     time.Time
	Body    any
}

// page serves a live page: the whole page, or with ?partial=1 (the
// page's own script asks for it) the part that updates.
func (h *Handler) page(name string, read func(context.Context, *http.Request) (any, time.Time, error)) http.HandlerFunc {
	title := map[string]string{"leases": "Leases", "jobs": "Jobs", "fleet": "Fleet", "job": "Job", "group": "Consumer group"}[name]
	return func(w http.ResponseWriter, r *http.Request) {
		body, now, err := read(r.Context(), r)
		if err != nil {
			code := http.StatusInternalServerError
			if se := (*statusError)(nil); errors.As(err, &se) {
				code = se.code
			}
			h.fail(w, r, code, err)
			return
		}
		v := view{Page: name, Title: title, Schema: h.schema, Refresh: h.cfg.Refresh.Milliseconds(), Actions: h.cfg.AllowActions, Now: now, Body: body}
		if b, ok := body.(jobBody); ok {
			v.Title = "Job " + printable.String(b.Job)
		}
		if b, ok := body.(groupBody); ok {
			v.Title = "Consumer group " + printable.String(b.Group)
		}
		tmpl := "layout"
		if r.FormValue("partial") == "1" {
			tmpl = "body"
		}
		h.render(w, http.StatusOK, name, tmpl, v)
	}
}

// render executes a page's template into a buffer first, so that a
// template error is a 500, not half a page.
func (h *Handler) render(w http.ResponseWriter, code int, page, tmpl string, v any) {
	var b strings.Builder
	if err := h.pages[page].ExecuteTemplate(&b, tmpl, v); err != nil {
		h.log.Error("pgfence web: render", "page", page, "err", err)
		http.Error(w, "pgfence web: the page could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(b.String()))
}

// fail answers with an error page (or, for api/, a JSON error).
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, code int, err error) {
	if strings.HasPrefix(r.URL.Path, "/api/") {
		writeJSON(w, code, map[string]string{"error": err.Error()})
		return
	}
	h.render(w, code, "error", "layout", view{Page: "error", Title: http.StatusText(code), Schema: h.schema, Body: printable.Text(err.Error())})
}

// api serves one JSON endpoint.
func (h *Handler) api(read func(context.Context, *http.Request) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v, err := read(r.Context(), r)
		if err != nil {
			code := http.StatusInternalServerError
			if errors.Is(err, errBadRequest) {
				code = http.StatusBadRequest
			}
			h.fail(w, r, code, err)
			return
		}
		writeJSON(w, http.StatusOK, v)
	}
}

var errBadRequest = errors.New("bad request")

func (h *Handler) apiRuns(ctx context.Context, r *http.Request) (any, error) {
	f := runner.RunFilter{Job: r.FormValue("job"), Status: runner.Status(r.FormValue("status")), Limit: 20}
	if s := r.FormValue("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 1000 {
			return nil, fmt.Errorf("%w: limit %q is not within 1..1000", errBadRequest, s)
		}
		f.Limit = n
	}
	return orEmpty(runner.Runs(ctx, h.pool, h.schema, f))
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// orEmpty makes a nil list an empty one, so that JSON says [] and not null.
func orEmpty[T any](list []T, err error) ([]T, error) {
	if list == nil && err == nil {
		list = []T{}
	}
	return list, err
}

// epoch reads the database history the schema issues tokens in.
func (h *Handler) epoch(ctx context.Context) (*schemaver.Epoch, error) {
	st, err := schemaver.Inspect(ctx, h.pool, h.schema)
	if err != nil {
		return nil, err
	}
	if st.Current < 1 {
		return nil, fmt.Errorf("web: schema %s is not migrated (pgfence migrate up)", h.schema)
	}
	return schemaver.ReadEpoch(ctx, h.pool, h.schema)
}

// fleetJSON is api/fleet's shape.
type fleetJSON struct {
	Instances  []runner.InstanceInfo  `json:"instances"`
	Partitions []runner.PartitionInfo `json:"partitions"`
	Terms      []runner.Term          `json:"terms"`
}

func (h *Handler) readFleet(ctx context.Context) (fleetJSON, error) {
	var (
		f   fleetJSON
		err error
	)
	if f.Instances, err = orEmpty(runner.Instances(ctx, h.pool, h.schema)); err != nil {
		return f, err
	}
	if f.Partitions, err = orEmpty(runner.Partitions(ctx, h.pool, h.schema, "")); err != nil {
		return f, err
	}
	f.Terms, err = orEmpty(runner.Terms(ctx, h.pool, h.schema, runner.TermFilter{}))
	return f, err
}

// errLine is how much of an error message a table cell shows; longer or
// multi-line messages open in a <details>.
const errLine = 160

// parsePages parses every page's templates: the layout and the page's
// body, by the name "body".
func parsePages() (map[string]*template.Template, error) {
	funcs := template.FuncMap{
		// Text from the database: control and format characters made
		// visible; html/template escapes the rest.
		"shown": printable.String,
		// An error message: its lines kept, the rest as "shown".
		"text":      printable.Text,
		"valueOf":   valueOf,
		"human":     human,
		"firstLine": func(s string) string { return firstLine(s, errLine) },
		"stands":    stands,
		"shard":     shardLabel,
		"utc":       func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
		"ms":        func(t time.Time) int64 { return t.UnixMilli() },
		"ago":       func(now, t time.Time) string { return human(now.Sub(t)) },
		"idOf":      idOf,
		"multiline": func(s string) bool { return strings.Contains(s, "\n") || len(s) > errLine },
		"duration":  func(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond },
		"neg":       func(d time.Duration) time.Duration { return -d },
		"add":       func(a, b int) int { return a + b },
		"stamp":     func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05 MST") },
	}
	base, err := template.New("pages").Funcs(funcs).ParseFS(assets, "assets/pages.html")
	if err != nil {
		return nil, fmt.Errorf("web: %w", err)
	}
	pages := map[string]*template.Template{}
	for _, name := range []string{"leases", "jobs", "fleet", "job", "group", "release", "error"} {
		t, err := base.Clone()
		if err == nil {
			_, err = t.New("body").Parse(`{{template "` + name + `" .}}`)
		}
		if err != nil {
			return nil, fmt.Errorf("web: %w", err)
		}
		pages[name] = t
	}
	return pages, nil
}

// idOf makes an element id from a kind and a name, stable across updates
// (the page's script puts the keyboard focus back on it) and safe in any
// name.
func idOf(kind string, parts ...any) string {
	f := fnv.New64a()
	for _, p := range parts {
		fmt.Fprintf(f, "%v\x00", p)
	}
	return fmt.Sprintf("%s-%x", kind, f.Sum64())
}
