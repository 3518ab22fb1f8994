package driver

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// A wedge goes on the VolumeAttachment as one Warning that names the volume,
// the step, the attachment pod and what else holds the VM, and its end as
// one Normal Event.
func TestWedgeEventsOnTheVolumeAttachment(t *testing.T) {
	ev := &fakeEvents{}
	r := NewWedgeEvents(ev)
	since := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	w := hotplug.Wedge{Reason: hotplug.WedgePlug, Since: since, State: "waiting for KubeVirt to plug the volume into the VM (VMI phase Bound)",
		AttachmentPod: "hp-volume-abcde", Others: []string{"pvc-old (Detaching, attachment pod hp-volume-old)"}}
	r.ReportWedge(context.Background(), hotplug.WedgeNotice{VM: "vm1", Volume: "pvc-a", Op: hotplug.Attach, Wedge: w})
	r.ReportWedge(context.Background(), hotplug.WedgeNotice{VM: "vm1", Volume: "pvc-a", Op: hotplug.Attach, Wedge: w, Cleared: true, Resumed: "VMI phase Ready"})
	if len(ev.got) != 2 {
		t.Fatalf("events %+v, want the wedge and its end", ev.got)
	}
	wedged, cleared := ev.got[0], ev.got[1]
	if wedged.volume != "pvc-a" || wedged.vm != "vm1" || wedged.eventType != "Warning" || wedged.reason != ReasonHotplugWedged {
		t.Errorf("wedge event %+v", wedged)
	}
	for _, want := range []string{"pvc-a", "vm1", hotplug.WedgePlug, "VMI phase Bound", "hp-volume-abcde", "pvc-old (Detaching", "2026-01-01T12:00:00Z", "troubleshooting"} {
		if !strings.Contains(wedged.message, want) {
			t.Errorf("wedge event %q does not say %q", wedged.message, want)
		}
	}
	if cleared.eventType != "Normal" || cleared.reason != ReasonHotplugWedgeCleared || !strings.Contains(cleared.message, "VMI phase Ready") {
		t.Errorf("end event %+v", cleared)
	}
}
