package web

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// releaseTimeout bounds a force release's wait for open guarded
// transactions on the lease, as the CLI's default --timeout does.
const releaseTimeout = 10 * time.Second

// errActionsOff answers every action while Config.AllowActions is off.
var errActionsOff = errors.New("actions are disabled on this status page (the handler was built without AllowActions; pgfence ui --allow-actions)")

// action guards an action's handler: refused with 403 unless actions are
// enabled. (Cross-origin POSTs were refused before this, by the
// handler's CrossOriginProtection.)
func (h *Handler) action(fn func(w http.ResponseWriter, r *http.Request)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !h.cfg.AllowActions {
			h.fail(w, r, http.StatusForbidden, errActionsOff)
			return
		}
		fn(w, r)
	}
}

// who names the requester for the ledger (requested_by, paused_by) and
// returns the identity the application supplied ("" if none).
func (h *Handler) who(r *http.Request) (by, identity string) {
	if h.cfg.Identity != nil {
		identity = h.cfg.Identity(r)
	}
	if identity != "" {
		return "pgfence-web:" + identity, identity
	}
	return "pgfence-web:" + r.RemoteAddr, ""
}

// logAction writes the one line each action gets, with who asked
// (identity, from who).
func (h *Handler) logAction(r *http.Request, identity, action string, err error, attrs ...any) {
	attrs = append([]any{"action", action, "remote_addr", r.RemoteAddr, "identity", identity}, attrs...)
	if err != nil {
		h.log.Warn("pgfence web: action failed", append(attrs, "err", err)...)
		return
	}
	h.log.Info("pgfence web: action", attrs...)
}

// seeOther sends the browser to a page relative to the handler's mount
// point (http.Redirect would make it absolute from the stripped path).
func seeOther(w http.ResponseWriter, to string) {
	w.Header().Set("Location", to)
	w.WriteHeader(http.StatusSeeOther)
}

// steerErr maps a runner error to its status code.
func steerErr(err error) int {
	switch {
	case errors.Is(err, runner.ErrUnknownJob), errors.Is(err, runner.ErrNoSuchShard), errors.Is(err, lock.ErrNoLease):
		return http.StatusNotFound
	case errors.Is(err, fence.ErrInvalidName), errors.Is(err, errBadRequest):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

func (h *Handler) runNow(w http.ResponseWriter, r *http.Request) {
	job := r.PostFormValue("job")
	shard := runner.AllShards
	if s := r.PostFormValue("shard"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			h.fail(w, r, http.StatusBadRequest, fmt.Errorf("shard %q is not a shard number", s))
			return
		}
		shard = n
	}
	by, identity := h.who(r)
	refs, err := runner.RunNow(r.Context(), h.pool, h.schema, job, shard, by)
	h.logAction(r, identity, "run", err, "job", job, "shard", shard, "runs", len(refs))
	if err != nil {
		h.fail(w, r, steerErr(err), err)
		return
	}
	// The job's page says what became of the run (or runs, one per
	// shard), read from the ledger.
	seeOther(w, "job?"+url.Values{"name": {job}, "done": {"run"}, "slot": {refs[0].Slot.UTC().Format(time.RFC3339Nano)}}.Encode())
}

// pause serves both pause and resume.
func (h *Handler) pause(w http.ResponseWriter, r *http.Request) {
	job := r.PostFormValue("job")
	by, identity := h.who(r)
	var err error
	action := "resume"
	if r.URL.Path == "/pause" {
		action = "pause"
		err = runner.Pause(r.Context(), h.pool, h.schema, job, by)
	} else {
		err = runner.Resume(r.Context(), h.pool, h.schema, job)
	}
	h.logAction(r, identity, action, err, "job", job)
	if err != nil {
		h.fail(w, r, steerErr(err), err)
		return
	}
	seeOther(w, "job?"+url.Values{"name": {job}, "done": {action}}.Encode())
}

// releaseBody is the confirmation page's data.
type releaseBody struct {
	Lease leaseRow
}

// confirmRelease asks what the CLI asks before a force release: the
// lease, its holder and token, and what releasing it does.
func (h *Handler) confirmRelease(w http.ResponseWriter, r *http.Request) {
	info, err := h.inspect(r.Context(), r.FormValue("name"))
	if err != nil {
		h.fail(w, r, steerErr(err), err)
		return
	}
	h.render(w, http.StatusOK, "release", "layout", view{Page: "release", Title: "Force release", Schema: h.schema,
		Actions: true, Now: info.ExpiresAt.Add(-info.ExpiresIn), Body: releaseBody{Lease: leaseRow{Info: info, State: stateOf(info)}}})
}

func (h *Handler) inspect(ctx context.Context, name string) (lock.Info, error) {
	if err := fence.ValidateName(name); err != nil {
		return lock.Info{}, err
	}
	return lock.Inspect(ctx, h.pool, h.schema, name)
}

// release force-releases the lease the confirmation page showed: only if
// its token is still the one shown, so that a lease that changed hands in
// between is not taken from its new holder.
func (h *Handler) release(w http.ResponseWriter, r *http.Request) {
	name := r.PostFormValue("name")
	shownTok, err := fence.ParseToken(r.PostFormValue("token"))
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, err)
		return
	}
	info, err := h.inspect(r.Context(), name)
	if err == nil && (info.Token != shownTok || info.Holder == "") {
		err = fmt.Errorf("%w: lease %s is now token %s held by %q, not token %s as confirmed; nothing released",
			errChanged, printable.String(name), info.Token, printable.String(info.Holder), shownTok)
	}
	var holder string
	if err == nil {
		ctx, cancel := context.WithTimeout(r.Context(), releaseTimeout)
		var freed lock.Freed
		freed, err = lock.ForceRelease(ctx, h.pool, h.schema, name)
		holder = freed.Holder
		cancel()
	}
	_, identity := h.who(r)
	h.logAction(r, identity, "release", err, "lease", name, "token", shownTok.String(), "holder", holder)
	var blocked *lock.BlockedError
	switch {
	case errors.Is(err, errChanged), errors.As(err, &blocked):
		h.fail(w, r, http.StatusConflict, err)
	case err != nil:
		h.fail(w, r, steerErr(err), err)
	default:
		seeOther(w, "./?"+url.Values{"done": {"release"}, "name": {name}, "token": {shownTok.String()}}.Encode())
	}
}

var errChanged = errors.New("the lease changed")
