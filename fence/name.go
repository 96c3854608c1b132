package fence

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// MaxNameLen is the longest lease or resource name, in bytes.
const MaxNameLen = 255

// ValidateName checks a lease or resource name: 1 to MaxNameLen bytes of
// valid UTF-8 without NUL. It returns an error wrapping ErrInvalidName.
func ValidateName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrInvalidName)
	case len(name) > MaxNameLen:
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrInvalidName, len(name), MaxNameLen)
	case !utf8.ValidString(name):
		return fmt.Errorf("%w: not valid UTF-8", ErrInvalidName)
	case strings.ContainsRune(name, 0):
		return fmt.Errorf("%w: contains a NUL byte", ErrInvalidName)
	}
	return nil
}
