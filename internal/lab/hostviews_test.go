package lab

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// hostWorld is what the host API server stores of one volume at one moment:
// the three objects hostVolumes lists. afterStage: a timed Longhorn stage
// (attach, detach, migration engine start) lies between the previous state
// and this one, seconds at the lab's scales, against the milliseconds of
// the three reads.
type hostWorld struct {
	what       string
	vol        simlonghorn.Volume
	tickets    map[string]bool // node -> satisfied
	hostVAs    map[string]string
	afterStage bool
}

const hvVolume = "pvc-moving"

// migrationWrites is the order in which the Longhorn stand-in, the host
// attach/detach controller and the csi-attacher write a migratable volume's
// objects while a guest volume moves from a VM on harvester-1 to one on
// harvester-0 (the target's attachment first, the source's release after),
// the source letting go before the migration engine is ready (early) or
// after it (late). host VolumeAttachments: "attached", "attaching" or
// "deleting".
func migrationWrites(early bool) []hostWorld {
	const from, to = "harvester-1", "harvester-0"
	vol := func(node, migration, cur, curMigration string) simlonghorn.Volume {
		v := simlonghorn.Volume{ObjectMeta: metav1.ObjectMeta{Name: hvVolume}}
		v.Spec.Migratable, v.Spec.AccessMode = true, simlonghorn.AccessModeReadWriteMany
		v.Spec.NodeID, v.Spec.MigrationNodeID = node, migration
		v.Status.State, v.Status.CurrentNodeID, v.Status.CurrentMigrationNodeID = simlonghorn.VolumeStateAttached, cur, curMigration
		return v
	}
	w := []hostWorld{{what: "attached on the source", vol: vol(from, "", from, ""),
		tickets: map[string]bool{from: true}, hostVAs: map[string]string{from: "attached"}}}
	next := func(what string, change func(*hostWorld)) {
		s := w[len(w)-1]
		s.what, s.afterStage = what, false
		s.tickets, s.hostVAs = copyMap(s.tickets), copyMap(s.hostVAs)
		change(&s)
		w = append(w, s)
	}
	release := func() {
		next("source host VolumeAttachment deleted", func(s *hostWorld) { s.hostVAs[from] = "deleting" })
		next("source ticket removed", func(s *hostWorld) { delete(s.tickets, from) })
	}
	next("target host VolumeAttachment created", func(s *hostWorld) { s.hostVAs[to] = "attaching" })
	next("target ticket added", func(s *hostWorld) { s.tickets[to] = false })
	next("migration started", func(s *hostWorld) { s.vol.Spec.MigrationNodeID = to })
	if early {
		release()
	}
	next("migration engine ready", func(s *hostWorld) { s.vol.Status.CurrentMigrationNodeID = to; s.afterStage = true })
	if !early {
		next("target ticket satisfied", func(s *hostWorld) { s.tickets[to] = true })
		release()
	}
	next("migration confirmed (spec)", func(s *hostWorld) { s.vol.Spec.NodeID, s.vol.Spec.MigrationNodeID = to, "" })
	if early {
		next("target ticket satisfied", func(s *hostWorld) { s.tickets[to] = true })
	}
	next("migration confirmed (status)", func(s *hostWorld) {
		s.vol.Status.CurrentNodeID, s.vol.Status.CurrentMigrationNodeID = to, ""
	})
	next("source host VolumeAttachment gone", func(s *hostWorld) { delete(s.hostVAs, from) })
	next("target host VolumeAttachment attached", func(s *hostWorld) { s.hostVAs[to] = "attached" })
	return w
}

func copyMap[V any](m map[string]V) map[string]V {
	out := make(map[string]V, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func (s hostWorld) longhornVA() *simlonghorn.VolumeAttachment {
	va := &simlonghorn.VolumeAttachment{
		Spec:   simlonghorn.VolumeAttachmentSpec{Volume: hvVolume, AttachmentTickets: map[string]*simlonghorn.AttachmentTicket{}},
		Status: simlonghorn.VolumeAttachmentStatus{AttachmentTicketStatuses: map[string]*simlonghorn.AttachmentTicketStatus{}},
	}
	for node, ok := range s.tickets {
		id := simlonghorn.AttachmentID(hvVolume, node)
		va.Spec.AttachmentTickets[id] = &simlonghorn.AttachmentTicket{ID: id, NodeID: node, Type: simlonghorn.AttacherTypeCSIAttacher, Generation: 1}
		va.Status.AttachmentTicketStatuses[id] = &simlonghorn.AttachmentTicketStatus{ID: id, Satisfied: ok, Generation: 1}
	}
	return va
}

func (s hostWorld) hostVolumeAttachments() []storagev1.VolumeAttachment {
	var out []storagev1.VolumeAttachment
	for node, st := range s.hostVAs {
		va := storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: "csi-" + node},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: simlonghorn.DriverName, NodeName: node,
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(hvVolume)}},
			Status: storagev1.VolumeAttachmentStatus{Attached: st != "attaching"},
		}
		if st == "deleting" {
			va.DeletionTimestamp = &metav1.Time{}
		}
		out = append(out, va)
	}
	return out
}

// readsInOrder checks every way hostVolumes' three reads (Longhorn volumes,
// then Longhorn VolumeAttachments, then host VolumeAttachments) can fall
// between the writes of w: the volume read at state i, the tickets at j >= i,
// the host VolumeAttachments at k >= j, none of them a Longhorn stage apart.
// It returns what the checker reports.
func readsInOrder(w []hostWorld) []string {
	var out []string
	for i := range w {
		for j := i; j < len(w); j++ {
			for k := j; k < len(w); k++ {
				if stageBetween(w, i, k) {
					continue
				}
				vol := w[i].vol
				views := hostVolumeViews([]*simlonghorn.Volume{&vol}, []*simlonghorn.VolumeAttachment{w[j].longhornVA()}, w[k].hostVolumeAttachments())
				for _, v := range invariants.RWOHostNodes(time.Time{}, views) {
					out = append(out, fmt.Sprintf("volume read at %q, tickets at %q, host VolumeAttachments at %q: %s",
						w[i].what, w[j].what, w[k].what, v.Details))
				}
			}
		}
	}
	return out
}

func stageBetween(w []hostWorld, from, to int) bool {
	for i := from + 1; i <= to; i++ {
		if w[i].afterStage {
			return true
		}
	}
	return false
}

// A Longhorn migration between host nodes, as the stand-in writes it, never
// looks like a double attachment to hostVolumes' reads, whatever moments
// they fall on: a node enters the views in the order engine, ticket, host
// VolumeAttachment and leaves them the other way round, and the reads go in
// that order, so a node new to a later read had entered the earlier views
// already unless a Longhorn stage lies between. Read the other way round,
// the writes of a source that lets go late would be reported.
func TestHostReadsOfAMigrationReportNothing(t *testing.T) {
	for _, early := range []bool{true, false} {
		t.Run(fmt.Sprintf("source released before the engine is ready=%v", early), func(t *testing.T) {
			w := migrationWrites(early)
			for _, got := range readsInOrder(w) {
				t.Error(got)
			}
			if early {
				return
			}
			// The check can fail: with the reads reversed, the source's host
			// VolumeAttachment read before the confirmed volume is two nodes
			// (when the source lets go after the migration engine is ready,
			// no stage lies between the two).
			reversed := 0
			for i := range w {
				for k := i; k < len(w); k++ {
					if stageBetween(w, i, k) {
						continue
					}
					vol := w[k].vol
					if len(invariants.RWOHostNodes(time.Time{}, hostVolumeViews([]*simlonghorn.Volume{&vol},
						[]*simlonghorn.VolumeAttachment{w[k].longhornVA()}, w[i].hostVolumeAttachments()))) > 0 {
						reversed++
					}
				}
			}
			if reversed == 0 {
				t.Error("host VolumeAttachments read before the volume: nothing reported, want the source and target at once")
			}
		})
	}
}

// What the stand-in stored when it wrote a pass's spec before its status:
// the migration confirmed in spec while the status still showed the engine
// on the source only and no migration engine. The checker reports it (the
// tickets read a moment later have the target satisfied), and it reports
// a real double attachment read between any two writes.
func TestHostReadsReportAStateLonghornNeverWrites(t *testing.T) {
	w := migrationWrites(true)
	var torn []hostWorld
	for _, s := range w {
		if s.what == "migration engine ready" {
			cut := s
			cut.what = "spec confirmed before the status"
			cut.vol.Spec.NodeID, cut.vol.Spec.MigrationNodeID = "harvester-0", ""
			cut.vol.Status.CurrentMigrationNodeID = ""
			torn = append(torn, cut)
			s.what, s.afterStage = "status stored after the spec", false
			s.vol.Spec = cut.vol.Spec
		}
		torn = append(torn, s)
	}
	got := readsInOrder(torn)
	if !slices.ContainsFunc(got, func(s string) bool {
		return strings.Contains(s, "engines on [harvester-1], satisfied tickets on [harvester-0]")
	}) {
		t.Errorf("the confirmation stored spec first is not reported as the source's engine and the target's ticket: %q", got)
	}
	// A real double attachment: the source's engine still running outside
	// a migration while the target's host VolumeAttachment says attached.
	double := []hostWorld{w[0], w[0]}
	double[1].what, double[1].hostVAs = "target attached without a migration", map[string]string{"harvester-1": "attached", "harvester-0": "attached"}
	if got := readsInOrder(double); len(got) == 0 {
		t.Error("engine on the source and the target's host VolumeAttachment attached, outside a migration: not reported")
	}
}
