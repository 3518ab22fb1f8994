package driver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

type fixedGuard struct{ err error }

func (g fixedGuard) Allow(context.Context, string, string) error { return g.err }
func (g fixedGuard) Done(string, string)                         {}

// Every error the queue's contract lists (hotplug.ErrNotReady), and each of
// the detach guard's, gets one gRPC code and one Event (or none) whether it
// ends a publish or an unpublish, and the answer keeps the error's text.
func TestEveryQueueErrorHasOneAnswer(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachines"}, "vm1", errors.New("cannot patch"))
	const warn, normal = "Warning", "Normal"
	for _, tc := range []struct {
		name      string
		err       error // from the queue
		guard     error // from the detach guard (unpublish only)
		code      codes.Code
		eventType string
		reason    string // empty: no Event
	}{
		{name: "not ready", err: hotplug.ErrNotReady, code: codes.Unavailable, eventType: warn, reason: "HotplugFailed"},
		{name: "stopped", err: fmt.Errorf("attach of volume v on VM vm1: %w", hotplug.ErrStopped), code: codes.Unavailable, eventType: warn, reason: "HotplugFailed"},
		{name: "held", err: &hotplug.HeldError{Volume: "v", VM: "vm2", State: "attached"}, code: codes.FailedPrecondition, eventType: warn, reason: "VolumeHeldByAnotherVM"},
		{name: "superseded", err: &hotplug.SupersededError{Volume: "v", VM: "vm1", By: hotplug.Detach}, code: codes.Aborted},
		{name: "rejected", err: &hotplug.RejectedError{Volume: "v", VM: "vm1", Err: errors.New("denied the request")}, code: codes.FailedPrecondition, eventType: warn, reason: "HotplugRejected"},
		{name: "claim gone", err: &hotplug.ClaimNotReadyError{Volume: "v", VM: "vm1"}, code: codes.NotFound, eventType: warn, reason: "HostClaimNotReady"},
		{name: "claim pending", err: &hotplug.ClaimNotReadyError{Volume: "v", VM: "vm1", Phase: "Pending"}, code: codes.Aborted, eventType: warn, reason: "HostClaimNotReady"},
		{name: "VM full", err: &hotplug.VMFullError{Volume: "v", VM: "vm1", Disks: 256, Limit: 256}, code: codes.ResourceExhausted, eventType: warn, reason: "DiskLimitReached"},
		{name: "VM over the limit, as KubeVirt says", err: &hotplug.RejectedError{Volume: "v", VM: "vm1", Err: fmt.Errorf("%w: %w", hotplug.ErrVMFull, errors.New("spec.template.spec.volumes: Too many: 257: must have at most 256 items"))},
			code: codes.ResourceExhausted, eventType: warn, reason: "DiskLimitReached"},
		{name: "VM not found", err: &hotplug.VMNotFoundError{VM: "vm1", Volume: "v", Namespace: "guests"}, code: codes.NotFound, eventType: warn, reason: "HotplugFailed"},
		{name: "expired", err: &hotplug.ExpiredError{Volume: "v", VM: "vm1"}, code: codes.Internal, eventType: warn, reason: "HotplugFailed"},
		{name: "stalled, refused", err: &hotplug.StalledError{Volume: "v", VM: "vm1", Cause: forbidden}, code: codes.PermissionDenied, eventType: warn, reason: "HostRefusedOrUnreachable"},
		{name: "stalled, unreachable", err: &hotplug.StalledError{Volume: "v", VM: "vm1", Cause: errors.New("connection refused")}, code: codes.Unavailable, eventType: warn, reason: "HostRefusedOrUnreachable"},
		{name: "stalled, cut off", err: &hotplug.StalledError{Volume: "v", VM: "vm1", Cause: context.Canceled}, code: codes.Unavailable},
		{name: "in progress", err: fmt.Errorf("attach of volume v on VM vm1 still in progress: %w", context.DeadlineExceeded), code: codes.DeadlineExceeded, eventType: normal, reason: "HotplugWaiting"},
		{name: "caller gone", err: fmt.Errorf("still in progress: %w", context.Canceled), code: codes.Canceled},
		{name: "wedged in KubeVirt", err: &hotplug.WedgedError{Volume: "v", VM: "vm1", Op: hotplug.Attach, Wedge: hotplug.Wedge{Reason: hotplug.WedgePlug, State: "waiting", AttachmentPod: "hp-volume-x"}, Err: context.DeadlineExceeded},
			code: codes.DeadlineExceeded},
		{name: "wedged in KubeVirt, caller gone", err: &hotplug.WedgedError{Volume: "v", VM: "vm1", Wedge: hotplug.Wedge{Reason: hotplug.WedgeUnplug}, Err: context.Canceled}, code: codes.Canceled},
		{name: "guest still uses it", guard: &guest.InUseError{Volume: "v", VM: "vm1", Nodes: []string{"n1"}}, code: codes.Aborted, eventType: normal, reason: "VolumeStillInUse"},
		{name: "guest use unknown", guard: guest.ErrNotSynced, code: codes.Unavailable, eventType: warn, reason: "HotplugFailed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := &fakeEvents{}
			c, _, hp := newTestController(ControllerOptions{Events: ev, DetachGuard: fixedGuard{tc.guard}})
			hp.holders["v"] = []string{"vm1"}
			hp.attach = func(context.Context, string, string) error { return tc.err }
			hp.detach = func(context.Context, string, string) error { return tc.err }
			vc := capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)
			calls := map[string]func() error{
				"unpublish": func() error {
					_, err := c.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: "v", NodeId: "vm1"})
					return err
				},
			}
			if tc.guard == nil {
				calls["publish"] = func() error {
					_, err := c.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: "v", NodeId: "vm1", VolumeCapability: vc})
					return err
				}
			}
			for call, do := range calls {
				ev.got = nil
				err := do()
				cause := tc.err
				if cause == nil {
					cause = tc.guard
				}
				if status.Code(err) != tc.code {
					t.Errorf("%s: code %v (%v), want %v", call, status.Code(err), err, tc.code)
				}
				if msg := status.Convert(err).Message(); !strings.Contains(msg, cause.Error()) {
					t.Errorf("%s: answer %q lost the cause %q", call, msg, cause)
				}
				switch {
				case tc.reason == "" && len(ev.got) != 0:
					t.Errorf("%s: events %+v, want none", call, ev.got)
				case tc.reason != "" && len(ev.got) != 1:
					t.Errorf("%s: %d events, want one %s", call, len(ev.got), tc.reason)
				case tc.reason != "" && (ev.got[0].eventType != tc.eventType || ev.got[0].reason != tc.reason):
					t.Errorf("%s: event %s %s, want %s %s", call, ev.got[0].eventType, ev.got[0].reason, tc.eventType, tc.reason)
				}
			}
		})
	}
}
