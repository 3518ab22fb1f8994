package simlonghorn

import (
	"context"
	"fmt"
	"sort"
	"time"

	"k8s.io/klog/v2"
)

// conditionSatisfied is v1beta2.AttachmentStatusConditionTypeSatisfied.
const conditionSatisfied = "Satisfied"

// progressVolume is the volume controller's part: it moves the engine
// towards spec.nodeID and spec.migrationNodeID through timed stages, and
// drops it when the volume is faulted.
func (s *Sim) progressVolume(ctx context.Context, v *Volume, now time.Time) {
	st := &v.Status
	if s.isFaulted(v.Name, now) {
		if st.Robustness != VolumeRobustnessFaulted {
			klog.FromContext(ctx).Info("Longhorn volume faulted", "volume", v.Name, "node", st.CurrentNodeID)
		}
		// A faulted volume's engine is gone: detached at once.
		st.Robustness = VolumeRobustnessFaulted
		st.State, st.CurrentNodeID, st.CurrentMigrationNodeID = VolumeStateDetached, "", ""
		s.clearStage(v.Name)
		return
	}
	want, cur := v.Spec.NodeID, st.CurrentNodeID
	switch {
	case cur != "" && want == "":
		st.State = VolumeStateDetaching
		if s.stageDone(v.Name, "detach", cur, s.detachTime(), now) {
			klog.FromContext(ctx).V(2).Info("Longhorn volume detached", "volume", v.Name, "node", cur)
			st.State, st.CurrentNodeID, st.CurrentMigrationNodeID = VolumeStateDetached, "", ""
		}
	case cur == "" && want != "":
		st.State = VolumeStateAttaching
		if s.stageDone(v.Name, "attach", want, realAttach, now) {
			klog.FromContext(ctx).V(2).Info("Longhorn volume attached", "volume", v.Name, "node", want)
			st.State, st.CurrentNodeID = VolumeStateAttached, want
		}
	case cur != "" && want != cur && want == st.CurrentMigrationNodeID:
		// Migration confirmed: the migration engine becomes the engine and
		// the old node's engine stops.
		klog.FromContext(ctx).Info("Longhorn migration confirmed", "volume", v.Name, "from", cur, "node", want)
		st.CurrentNodeID, st.CurrentMigrationNodeID = want, ""
		s.clearStage(v.Name)
	case cur != "" && want != cur:
		// The VolumeAttachment controller never moves an attached engine
		// other than by migration; detach first.
		st.State = VolumeStateDetaching
		if s.stageDone(v.Name, "detach", cur, s.detachTime(), now) {
			st.State, st.CurrentNodeID, st.CurrentMigrationNodeID = VolumeStateDetached, "", ""
		}
	case cur != "":
		st.State = VolumeStateAttached
		s.progressMigration(ctx, v, now)
	default:
		st.State = VolumeStateDetached
		s.clearStage(v.Name)
	}
	st.Robustness = VolumeRobustnessUnknown
	if st.State == VolumeStateAttached {
		st.Robustness = VolumeRobustnessHealthy
	}
}

// progressMigration starts the migration engine on spec.migrationNodeID and
// stops it when the migration is rolled back.
func (s *Sim) progressMigration(ctx context.Context, v *Volume, now time.Time) {
	st := &v.Status
	switch m := v.Spec.MigrationNodeID; {
	case m != "" && st.CurrentMigrationNodeID != m:
		if s.stageDone(v.Name, "migrate", m, realMigrateEngine, now) {
			klog.FromContext(ctx).Info("Longhorn migration engine ready", "volume", v.Name, "node", m)
			st.CurrentMigrationNodeID = m
		}
	case m == "" && st.CurrentMigrationNodeID != "":
		if s.stageDone(v.Name, "unmigrate", st.CurrentMigrationNodeID, s.detachTime(), now) {
			klog.FromContext(ctx).Info("Longhorn migration rolled back", "volume", v.Name, "node", st.CurrentMigrationNodeID)
			st.CurrentMigrationNodeID = ""
		}
	default:
		s.clearStage(v.Name)
	}
}

func (s *Sim) detachTime() time.Duration {
	s.mu.Lock()
	f := s.slowDetach
	s.mu.Unlock()
	if f > 1 {
		return time.Duration(float64(realDetach) * f)
	}
	return realDetach
}

// stageDone starts the stage (kind, node) if another one was under way and
// says whether it has run its (jittered) duration.
func (s *Sim) stageDone(volume, kind, node string, real time.Duration, now time.Time) bool {
	s.mu.Lock()
	cur := s.stages[volume]
	if cur == nil || cur.kind != kind || cur.node != node {
		cur = &stage{kind: kind, node: node, doneAt: now.Add(s.jitteredLocked(real))}
		s.stages[volume] = cur
	}
	done := !now.Before(cur.doneAt)
	if done {
		delete(s.stages, volume)
	}
	s.mu.Unlock()
	return done
}

func (s *Sim) clearStage(volume string) {
	s.mu.Lock()
	delete(s.stages, volume)
	s.mu.Unlock()
}

func isMigratable(v *Volume) bool {
	return v.Spec.Migratable && v.Spec.AccessMode == AccessModeReadWriteMany
}

func isMigrating(v *Volume) bool {
	return v.Spec.MigrationNodeID != "" || v.Status.CurrentMigrationNodeID != ""
}

// availableOn is an engine running on node (longhorn-manager v1.10.1
// csi/controller_server.go:1369-1381): the volume's or the migration's.
func availableOn(v *Volume, node string) bool {
	return v.Status.State == VolumeStateAttached && node != "" &&
		(v.Status.CurrentNodeID == node || v.Status.CurrentMigrationNodeID == node)
}

func csiTickets(va *VolumeAttachment) []*AttachmentTicket {
	var out []*AttachmentTicket
	for _, t := range va.Spec.AttachmentTickets {
		if t != nil && t.Type == AttacherTypeCSIAttacher {
			out = append(out, t)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func ticketFor(va *VolumeAttachment, node string) bool {
	for _, t := range csiTickets(va) {
		if t.NodeID == node {
			return true
		}
	}
	return false
}

// decideAttachment is longhorn-manager v1.10.1
// controller/volume_attachment_controller.go for CSI tickets: detachment
// (:545-601), attachment (:636-713) and migration (:384-541), in that order.
func decideAttachment(ctx context.Context, va *VolumeAttachment, v *Volume) {
	log := klog.FromContext(ctx).WithValues("volume", v.Name)
	faulted := v.Status.Robustness == VolumeRobustnessFaulted
	// Detachment: no ticket for the current node (or faulted), unless a
	// migration is under way, which the migration rules end.
	if v.Spec.NodeID != "" && (faulted || (!(isMigratable(v) && isMigrating(v)) && !ticketFor(va, v.Spec.NodeID))) {
		log.Info("Longhorn volume selected to detach", "node", v.Spec.NodeID)
		v.Spec.NodeID = ""
	}
	// Attachment: only once fully detached, so an RWO volume leaves one node
	// before it is attached on another.
	if v.Spec.NodeID == "" && v.Status.CurrentNodeID == "" && v.Status.State == VolumeStateDetached && !faulted {
		tickets := csiTickets(va)
		switch {
		case len(tickets) == 0:
		case isMigratable(v) && len(tickets) > 1:
			// Every pass finds it again until a ticket goes: keep it out of
			// the default log.
			log.V(2).Info("Longhorn migration failed: detach the volume from the extra node to resume",
				"node", tickets[0].NodeID, "otherNode", tickets[1].NodeID)
		default:
			log.Info("Longhorn volume selected to attach", "node", tickets[0].NodeID)
			v.Spec.NodeID = tickets[0].NodeID
		}
	}
	decideMigration(log, va, v)
}

func decideMigration(log klog.Logger, va *VolumeAttachment, v *Volume) {
	if !isMigratable(v) {
		return
	}
	if v.Spec.NodeID == "" {
		v.Spec.MigrationNodeID = ""
		return
	}
	// Start: attached where a ticket asks, and a ticket asks elsewhere.
	if !isMigrating(v) && v.Status.State == VolumeStateAttached && v.Status.CurrentNodeID == v.Spec.NodeID &&
		ticketFor(va, v.Spec.NodeID) {
		for _, t := range csiTickets(va) {
			if t.NodeID != v.Spec.NodeID {
				log.Info("Longhorn migration started", "from", v.Spec.NodeID, "node", t.NodeID)
				v.Spec.MigrationNodeID = t.NodeID
				break
			}
		}
	}
	// Confirm: the old node's ticket is gone and the migration engine is
	// ready.
	if m := v.Status.CurrentMigrationNodeID; m != "" && !ticketFor(va, v.Spec.NodeID) && availableOn(v, m) {
		v.Spec.NodeID, v.Spec.MigrationNodeID = m, ""
	}
	// Roll back: the new node's ticket is gone.
	if v.Spec.MigrationNodeID != "" && !ticketFor(va, v.Spec.MigrationNodeID) {
		log.Info("Longhorn migration rolling back", "node", v.Spec.MigrationNodeID)
		v.Spec.MigrationNodeID = ""
	}
}

// updateTicketStatuses is handleVAStatusUpdate (volume_attachment_controller.go:715-860).
func updateTicketStatuses(va *VolumeAttachment, v *Volume) {
	if va.Status.AttachmentTicketStatuses == nil {
		va.Status.AttachmentTicketStatuses = map[string]*AttachmentTicketStatus{}
	}
	for id := range va.Status.AttachmentTicketStatuses {
		if _, ok := va.Spec.AttachmentTickets[id]; !ok {
			delete(va.Status.AttachmentTicketStatuses, id)
		}
	}
	for id, t := range va.Spec.AttachmentTickets {
		st := va.Status.AttachmentTicketStatuses[id]
		if st == nil {
			st = &AttachmentTicketStatus{ID: id}
			va.Status.AttachmentTicketStatuses[id] = st
		}
		st.Generation = t.Generation
		ok, msg := ticketSatisfied(t, v)
		st.Satisfied = ok
		status := "False"
		if ok {
			status = "True"
		}
		st.Conditions = []Condition{{Type: conditionSatisfied, Status: status, Message: msg}}
	}
}

func ticketSatisfied(t *AttachmentTicket, v *Volume) (bool, string) {
	if isMigratable(v) && isMigrating(v) && t.Type == AttacherTypeCSIAttacher && t.NodeID == v.Status.CurrentMigrationNodeID {
		if availableOn(v, t.NodeID) {
			return true, "The migrating attachment ticket is satisfied"
		}
		return false, fmt.Sprintf("waiting for volume to migrate to node %v", t.NodeID)
	}
	switch {
	case v.Status.CurrentNodeID == "" || v.Status.State != VolumeStateAttached:
		return false, ""
	case t.NodeID != v.Status.CurrentNodeID:
		return false, fmt.Sprintf("the volume is currently attached to different node %v ", v.Status.CurrentNodeID)
	}
	return true, ""
}
