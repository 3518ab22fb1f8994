package lab

import (
	"fmt"
	"testing"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// The host-node invariant reads each view where it says where a volume is:
// Longhorn's engines, its satisfied tickets, and the host's attached
// VolumeAttachments of Longhorn's driver that are not being detached.
func TestHostVolumeViews(t *testing.T) {
	vol := func(name, node, migration string, migratable bool) *simlonghorn.Volume {
		v := &simlonghorn.Volume{ObjectMeta: metav1.ObjectMeta{Name: name}}
		v.Spec.Migratable, v.Spec.AccessMode = migratable, simlonghorn.AccessModeReadWriteOnce
		if migratable {
			v.Spec.AccessMode = simlonghorn.AccessModeReadWriteMany
		}
		v.Spec.MigrationNodeID = migration
		v.Status.CurrentNodeID = node
		return v
	}
	lva := func(name string, satisfied map[string]bool) *simlonghorn.VolumeAttachment {
		va := &simlonghorn.VolumeAttachment{Spec: simlonghorn.VolumeAttachmentSpec{Volume: name, AttachmentTickets: map[string]*simlonghorn.AttachmentTicket{}},
			Status: simlonghorn.VolumeAttachmentStatus{AttachmentTicketStatuses: map[string]*simlonghorn.AttachmentTicketStatus{}}}
		for node, ok := range satisfied {
			id := simlonghorn.AttachmentID(name, node)
			va.Spec.AttachmentTickets[id] = &simlonghorn.AttachmentTicket{ID: id, NodeID: node, Generation: 1}
			va.Status.AttachmentTicketStatuses[id] = &simlonghorn.AttachmentTicketStatus{ID: id, Satisfied: ok, Generation: 1}
		}
		return va
	}
	hva := func(pv, node, attacher string, attached, deleting bool) storagev1.VolumeAttachment {
		va := storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("csi-%s-%s", pv, node)},
			Spec:       storagev1.VolumeAttachmentSpec{Attacher: attacher, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pv)}},
			Status:     storagev1.VolumeAttachmentStatus{Attached: attached},
		}
		if deleting {
			va.DeletionTimestamp = &metav1.Time{}
		}
		return va
	}
	got := hostVolumeViews(
		[]*simlonghorn.Volume{vol("pv-a", "h0", "", false), vol("pv-b", "h1", "h2", true)},
		[]*simlonghorn.VolumeAttachment{lva("pv-a", map[string]bool{"h0": true, "h1": false}), lva("pv-b", map[string]bool{"h1": true, "h2": true})},
		[]storagev1.VolumeAttachment{
			hva("pv-a", "h0", simlonghorn.DriverName, true, false),
			hva("pv-a", "h1", simlonghorn.DriverName, true, true),    // being detached
			hva("pv-a", "h2", simlonghorn.DriverName, false, false),  // not attached yet
			hva("pv-a", "h2", "driver.harvesterhci.io", true, false), // another driver's
			hva("pv-b", "h2", simlonghorn.DriverName, true, false),
		})
	want := "pv-a migratable=false migrating=false engines=[h0] tickets=[h0] hostVAs=[h0]; " +
		"pv-b migratable=true migrating=true engines=[h1] tickets=[h1 h2] hostVAs=[h2]; "
	s := ""
	for _, v := range got {
		tickets := v.Tickets
		if len(tickets) == 2 && tickets[0] > tickets[1] {
			tickets[0], tickets[1] = tickets[1], tickets[0]
		}
		s += fmt.Sprintf("%s migratable=%v migrating=%v engines=%v tickets=%v hostVAs=%v; ", v.Name, v.Migratable, v.Migrating, v.Engines, tickets, v.HostVAs)
	}
	if s != want {
		t.Errorf("got  %s\nwant %s", s, want)
	}
}
