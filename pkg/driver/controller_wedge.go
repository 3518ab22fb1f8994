package driver

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Reasons of the Events that say a hotplug is wedged in KubeVirt, and that
// it goes on again.
const (
	ReasonHotplugWedged       = "HotplugWedged"
	ReasonHotplugWedgeCleared = "HotplugWedgeCleared"
)

// wedgeEvents puts the queue's wedges on the guest VolumeAttachment of the
// volume and VM, where `kubectl describe volumeattachment` shows them
// beside the attacher's error. The queue reports each wedge once when it
// begins and once when it ends, so an operator sees one Warning per wedge;
// the answers to the attacher's retries in between post nothing more (the
// WedgedError row of answers has no Event).
type wedgeEvents struct{ events AttachmentEvents }

// NewWedgeEvents reports the queue's wedges as Events through events.
func NewWedgeEvents(events AttachmentEvents) hotplug.WedgeReporter { return wedgeEvents{events} }

func (e wedgeEvents) ReportWedge(ctx context.Context, n hotplug.WedgeNotice) {
	// A queue worker waits for this: the read of the VolumeAttachment is
	// bounded, and the broadcaster sends the Event itself in the background.
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	if n.Cleared {
		e.events.Record(ctx, n.Volume, n.VM, corev1.EventTypeNormal, ReasonHotplugWedgeCleared, fmt.Sprintf(
			"%s of volume %s on VM %s is no longer wedged in KubeVirt (%s, wedged since %s): %s",
			n.Op, n.Volume, n.VM, n.Wedge.Reason, n.Wedge.Since.UTC().Format(time.RFC3339), n.Resumed))
		return
	}
	e.events.Record(ctx, n.Volume, n.VM, corev1.EventTypeWarning, ReasonHotplugWedged, fmt.Sprintf(
		"%s of volume %s on VM %s is wedged in KubeVirt (%s): %s; it goes on by itself once KubeVirt moves, docs/troubleshooting.md (\"A VM wedged in KubeVirt\") says how to get it moving",
		n.Op, n.Volume, n.VM, n.Wedge.Reason, n.Wedge.Describe()))
}
