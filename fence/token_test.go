package fence_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// Tokens are decimal strings in JSON, in every exported struct that holds
// one: exact for readers that hold numbers as doubles (2^53 + 1 is not a
// double), and read back to the same token.
func TestTokensAreDecimalStringsInJSON(t *testing.T) {
	const big = fence.Token(1<<53 + 1)
	for _, v := range []any{
		lock.Info{Name: "n", Token: big},
		runner.RunInfo{Job: "j", Token: big, Slot: time.Unix(0, 0).UTC()},
		runner.Event{Job: "j", Token: big},
		struct{ Token fence.Token }{big},
	} {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), `"9007199254740993"`) || strings.Contains(string(b), ":9007199254740993") {
			t.Errorf("%T in JSON: %s; want the token as the string \"9007199254740993\"", v, b)
		}
	}
	var back struct{ Token fence.Token }
	if err := json.Unmarshal([]byte(`{"Token":"9007199254740993"}`), &back); err != nil || back.Token != big {
		t.Fatalf("read back: %v, %v", back.Token, err)
	}
	// The zero value ("no token": a job without a leader) reads back too;
	// a negative token does not.
	back.Token = 5
	if err := json.Unmarshal([]byte(`{"Token":"0"}`), &back); err != nil || back.Token != 0 {
		t.Fatalf("read back the zero token: %v, %v", back.Token, err)
	}
	var jobs []runner.JobInfo
	if err := json.Unmarshal([]byte(`[{"job":"j","token":"0"}]`), &jobs); err != nil || jobs[0].Token != 0 {
		t.Fatalf("a job without a leader read back: %+v, %v", jobs, err)
	}
	if err := json.Unmarshal([]byte(`{"Token":"-1"}`), &back); !errors.Is(err, fence.ErrInvalidToken) {
		t.Fatalf("a negative token read: %v, want ErrInvalidToken", err)
	}
}

// ParseToken and Token.UnmarshalText accept the same texts, with the same
// value: every token String writes (the zero value "0" included), and
// nothing else.
func TestParseTokenAgreesWithUnmarshalText(t *testing.T) {
	for _, in := range []string{"0", "1", "42", "9223372036854775807", "-1", "", " 1", "1.0", "0x10", "9223372036854775808", "+5"} {
		parsed, perr := fence.ParseToken(in)
		var un fence.Token
		uerr := un.UnmarshalText([]byte(in))
		if (perr == nil) != (uerr == nil) || parsed != un {
			t.Errorf("%q: ParseToken = %v, %v; UnmarshalText = %v, %v", in, parsed, perr, un, uerr)
		}
		if perr != nil && !errors.Is(perr, fence.ErrInvalidToken) {
			t.Errorf("%q: %v does not match ErrInvalidToken", in, perr)
		}
		if perr == nil && parsed.String() != strings.TrimPrefix(in, "+") {
			t.Errorf("%q parses to %v, which String writes back as %q", in, parsed, parsed.String())
		}
	}
	if tok, err := fence.ParseToken(fence.Token(0).String()); err != nil || tok != 0 {
		t.Errorf("the zero value's text does not parse back: %v, %v", tok, err)
	}
}
