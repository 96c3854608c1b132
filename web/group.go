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
	"github.com/pgfence/pgfence/runner"
)

// The group page: one consumer group's partitions and their terms.

// groupTerms is how many terms the group page lists.
const groupTerms = 50

// groupBody is what the group page shows.
type groupBody struct {
	Group      string
	Partitions []runner.PartitionInfo
	Terms      []runner.Term
	// Notice says what a seek just did, as the database shows it now.
	Notice string
}

func (h *Handler) group(ctx context.Context, r *http.Request) (any, time.Time, error) {
	name := r.FormValue("name")
	if name == "" {
		return nil, time.Time{}, badRequest("parameter \"name\": a consumer group's name is required")
	}
	if err := fence.ValidateName(name); err != nil {
		return nil, time.Time{}, badRequest("parameter \"name\": %v", err)
	}
	b := groupBody{Group: name}
	var err error
	if b.Partitions, err = runner.Partitions(ctx, h.pool, h.schema, name); err != nil {
		return nil, time.Time{}, err
	}
	if len(b.Partitions) == 0 {
		return nil, time.Time{}, notFound("no consumer group named %q has had a leader in schema %s", name, h.schema)
	}
	if b.Terms, err = runner.Terms(ctx, h.pool, h.schema, runner.TermFilter{Group: name, Limit: groupTerms}); err != nil {
		return nil, time.Time{}, err
	}
	if r.FormValue("done") == "seek" {
		b.Notice = seekNotice(r, b.Partitions)
	}
	return b, b.Partitions[0].Now, nil
}

// seekNotice says what the seek the page was reached from did, from the
// partitions as read now.
func seekNotice(r *http.Request, parts []runner.PartitionInfo) string {
	p, err := strconv.Atoi(r.FormValue("partition"))
	if err != nil {
		return ""
	}
	for _, in := range parts {
		if in.Partition == p {
			return fmt.Sprintf("Partition %d sought from offset %s to %s: its offset is now %d (token %s), and its leader's "+
				"term was revoked; the next leader resumes there.", p, r.FormValue("before"), r.FormValue("offset"), in.Offset, in.Token)
		}
	}
	return ""
}

// seek sets a partition's offset through its fence (runner.Seek).
func (h *Handler) seek(w http.ResponseWriter, r *http.Request) {
	group := r.PostFormValue("group")
	partition, err := strconv.Atoi(r.PostFormValue("partition"))
	if err != nil || partition < 0 {
		h.fail(w, r, http.StatusBadRequest, fmt.Errorf("%w: parameter \"partition\": %q is not a partition number", errBadRequest, r.PostFormValue("partition")))
		return
	}
	offset, err := strconv.ParseInt(r.PostFormValue("offset"), 10, 64)
	if err != nil || offset < 0 {
		h.fail(w, r, http.StatusBadRequest, fmt.Errorf("%w: parameter \"offset\": %q is not an offset (0 or more)", errBadRequest, r.PostFormValue("offset")))
		return
	}
	by, identity := h.who(r)
	ctx, cancel := context.WithTimeout(r.Context(), releaseTimeout)
	before, err := runner.Seek(ctx, h.pool, h.schema, group, partition, offset, by)
	cancel()
	h.logAction(r, identity, "seek", err, "group", group, "partition", partition, "offset", offset, "before", before)
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		h.fail(w, r, http.StatusConflict, fmt.Errorf("the partition's guarded transactions did not end within %v; nothing sought: %w", releaseTimeout, err))
	case err != nil:
		h.fail(w, r, steerErr(err), err)
	default:
		seeOther(w, "group?"+url.Values{"name": {group}, "done": {"seek"}, "partition": {strconv.Itoa(partition)},
			"offset": {strconv.FormatInt(offset, 10)}, "before": {strconv.FormatInt(before, 10)}}.Encode())
	}
}
