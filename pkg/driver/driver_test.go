package driver

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// An answer the caller retries by design is not an error in the log: an
// operator grepping for errors must find the calls that failed, not every
// detach that waits for the guest's unmount.
func TestRetryableAnswersAreLoggedBelowErrorLevel(t *testing.T) {
	for _, tc := range []struct {
		err       error
		wantError bool
		wantV     int // the level of the line, when not an error
	}{
		{status.Error(codes.Aborted, "volume pvc-a is still in use by guest node n1"), false, 2},
		{status.Error(codes.DeadlineExceeded, "still attaching"), false, 2},
		{status.Error(codes.Unavailable, "controller not ready: waiting for the host's VM and VMI caches to sync"), false, 0},
		{status.Error(codes.Internal, "boom"), true, 0},
		{status.Error(codes.FailedPrecondition, "held by VM other"), true, 0},
		{errors.New("plain"), true, 0},
	} {
		var lines []string
		logger := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{Verbosity: 4, LogInfoLevel: ptr("v")})
		ctx := klog.NewContext(context.Background(), logger)
		_, _ = logCalls(ctx, nil, &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Controller/ControllerUnpublishVolume"}, func(context.Context, any) (any, error) { return nil, tc.err })
		var last string
		for _, l := range lines {
			if !strings.Contains(l, `"msg"="call"`) {
				last = l
			}
		}
		isError := strings.Contains(last, `"error"=`)
		if isError != tc.wantError {
			t.Errorf("%v: logged %q, want error=%v", tc.err, last, tc.wantError)
		}
		if !tc.wantError && !strings.Contains(last, `"v"=`+string(rune('0'+tc.wantV))) {
			t.Errorf("%v: logged %q, want level %d", tc.err, last, tc.wantV)
		}
	}
}

func ptr(s string) *string { return &s }
