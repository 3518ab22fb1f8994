package integration

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// answering answers every ControllerPublishVolume with its code.
type answering struct {
	csi.ControllerClient
	code  codes.Code
	calls int
}

func (a *answering) ControllerPublishVolume(context.Context, *csi.ControllerPublishVolumeRequest, ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	a.calls++
	return nil, status.Error(a.code, "answered "+a.code.String())
}

// TestAttacherStopsAtTheAttachersFinalAnswers: the suites' attacher returns
// the first answer the external-attacher takes as final (Internal and Unknown
// among them: a driver that breaks fails the test at once) and retries the
// ones that say the operation may still be in progress.
func TestAttacherStopsAtTheAttachersFinalAnswers(t *testing.T) {
	for code, final := range map[codes.Code]bool{codes.Internal: true, codes.Unknown: true, codes.Unimplemented: true,
		codes.FailedPrecondition: true, codes.Aborted: false, codes.Unavailable: false, codes.ResourceExhausted: false} {
		c := &answering{code: code}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := newAttacher(func() csi.ControllerClient { return c }).publish(ctx, "vm", "vol")
		cancel()
		if got := c.calls == 1; got != final {
			t.Errorf("%s: %d calls (%v), want the attacher to stop at it: %v", code, c.calls, err, final)
		}
		if status.Code(err) != code {
			t.Errorf("%s: answered %v", code, err)
		}
	}
}
