package host

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Longhorn keeps a Volume and a VolumeAttachment (its attachment tickets)
// per volume in longhorn-system, group longhorn.io, version v1beta2
// (longhorn-manager v1.10.1 k8s/pkg/apis/longhorn/v1beta2/register.go); the
// VolumeAttachment has the volume's name (types/types.go,
// GetLHVolumeAttachmentNameFromVolumeName). The driver only reads a few
// status fields, so it declares them here with longhorn-manager's JSON names
// instead of importing longhorn-manager, whose Kubernetes libraries are
// newer than this module's.
var (
	LonghornVolumeResource     = schema.GroupVersionResource{Group: "longhorn.io", Version: "v1beta2", Resource: "volumes"}
	LonghornAttachmentResource = schema.GroupVersionResource{Group: "longhorn.io", Version: "v1beta2", Resource: "volumeattachments"}
)

// LonghornNamespace is where Longhorn keeps its objects on Harvester.
const LonghornNamespace = "longhorn-system"

// Values of Longhorn's volume status (longhorn-manager v1.10.1
// k8s/pkg/apis/longhorn/v1beta2/volume.go: VolumeState, VolumeRobustness,
// VolumeConditionTypeScheduled).
const (
	LonghornStateAttached    = "attached"
	LonghornStateDetached    = "detached"
	LonghornRobustnessFaulty = "faulted"
	longhornScheduled        = "Scheduled"
)

// LonghornVolume is the part of a longhorn.io/v1beta2 Volume the driver
// reads (volume.go: VolumeSpec, VolumeStatus, KubernetesStatus).
type LonghornVolume struct {
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              LonghornVolumeSpec   `json:"spec"`
	Status            LonghornVolumeStatus `json:"status"`
}

// LonghornVolumeSpec: nodeID and migrationNodeID are where Longhorn's
// VolumeAttachment controller wants the engine and the migration engine.
type LonghornVolumeSpec struct {
	NodeID          string `json:"nodeID"`
	MigrationNodeID string `json:"migrationNodeID"`
	Migratable      bool   `json:"migratable"`
	AccessMode      string `json:"accessMode"`
}

// LonghornVolumeStatus: currentNodeID is the host node whose engine serves
// the volume, ownerID the longhorn-manager that reconciles it.
type LonghornVolumeStatus struct {
	OwnerID                string                  `json:"ownerID"`
	State                  string                  `json:"state"`
	Robustness             string                  `json:"robustness"`
	CurrentNodeID          string                  `json:"currentNodeID"`
	CurrentMigrationNodeID string                  `json:"currentMigrationNodeID"`
	KubernetesStatus       LonghornKubernetesState `json:"kubernetesStatus"`
	Conditions             []LonghornCondition     `json:"conditions"`
}

// LonghornKubernetesState ties the volume to its PV, PVC and the pods that
// use it; Longhorn's NodePublish checks workloadsStatus (csi/node_server.go).
type LonghornKubernetesState struct {
	PVName          string             `json:"pvName"`
	Namespace       string             `json:"namespace"`
	PVCName         string             `json:"pvcName"`
	WorkloadsStatus []LonghornWorkload `json:"workloadsStatus"`
}

// LonghornWorkload is one pod of workloadsStatus.
type LonghornWorkload struct {
	PodName   string `json:"podName"`
	PodStatus string `json:"podStatus"`
}

// LonghornCondition is a Longhorn status condition.
type LonghornCondition struct {
	Type    string `json:"type"`
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

// LonghornTicket is one attachment ticket of a Longhorn VolumeAttachment
// with its status (volumeattachment.go: AttachmentTicket,
// AttachmentTicketStatus).
type LonghornTicket struct {
	ID        string
	Type      string
	NodeID    string
	Satisfied bool
	// Message is the Satisfied condition's message of an unsatisfied
	// ticket (why Longhorn does not attach it yet).
	Message string
}

type longhornAttachment struct {
	Spec struct {
		AttachmentTickets map[string]*struct {
			ID         string `json:"id"`
			Type       string `json:"type"`
			NodeID     string `json:"nodeID"`
			Generation int64  `json:"generation"`
		} `json:"attachmentTickets"`
	} `json:"spec"`
	Status struct {
		AttachmentTicketStatuses map[string]*struct {
			Satisfied  bool                `json:"satisfied"`
			Conditions []LonghornCondition `json:"conditions"`
			Generation int64               `json:"generation"`
		} `json:"attachmentTicketStatuses"`
	} `json:"status"`
}

// GetLonghornVolume reads a Longhorn volume. A host without Longhorn's CRDs
// answers NotFound, as for a volume that does not exist.
func (c *Client) GetLonghornVolume(ctx context.Context, name string) (*LonghornVolume, error) {
	u, err := c.Dynamic.Resource(LonghornVolumeResource).Namespace(LonghornNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read Longhorn volume %s: %w", name, err)
	}
	var v LonghornVolume
	if err := fromUnstructured(u, &v); err != nil {
		return nil, fmt.Errorf("Longhorn volume %s: %w", name, err)
	}
	return &v, nil
}

// GetLonghornTickets reads the attachment tickets of a Longhorn volume,
// sorted by ID. A ticket is satisfied only by a status of its own
// generation (volumeattachment.go, IsAttachmentTicketSatisfied).
func (c *Client) GetLonghornTickets(ctx context.Context, volume string) ([]LonghornTicket, error) {
	u, err := c.Dynamic.Resource(LonghornAttachmentResource).Namespace(LonghornNamespace).Get(ctx, volume, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read Longhorn VolumeAttachment %s: %w", volume, err)
	}
	var va longhornAttachment
	if err := fromUnstructured(u, &va); err != nil {
		return nil, fmt.Errorf("Longhorn VolumeAttachment %s: %w", volume, err)
	}
	var out []LonghornTicket
	for id, t := range va.Spec.AttachmentTickets {
		if t == nil {
			continue
		}
		lt := LonghornTicket{ID: id, Type: t.Type, NodeID: t.NodeID}
		if st := va.Status.AttachmentTicketStatuses[id]; st != nil {
			lt.Satisfied = st.Satisfied && st.Generation == t.Generation
			for _, c := range st.Conditions {
				if c.Type == "Satisfied" && !lt.Satisfied {
					lt.Message = c.Message
				}
			}
		}
		out = append(out, lt)
	}
	slices.SortFunc(out, func(a, b LonghornTicket) int { return cmp.Compare(a.ID, b.ID) })
	return out, nil
}

// NotReady says why Longhorn refuses the volume to workloads ("" when it
// does not): ControllerPublish answers Aborted "volume %s is not ready for
// workloads" then (longhorn-manager v1.10.1 csi/controller_server.go:519-521,
// readiness from types/volumes.go IsVolumeReady). The transient "waiting for
// the volume to fully detach" is left out: it passes by itself.
func (v *LonghornVolume) NotReady() string {
	switch {
	case v.Status.Robustness == LonghornRobustnessFaulty:
		return "faulted (no healthy replica)"
	case v.Status.State == LonghornStateDetached:
		for _, c := range v.Status.Conditions {
			if c.Type == longhornScheduled && c.Status != "True" {
				return "detached with replicas that cannot be scheduled" + conditionDetail(c)
			}
		}
	}
	return ""
}

// Migrating says whether Longhorn is moving the volume's engine between
// host nodes (spec.migrationNodeID set, or a migration engine running).
func (v *LonghornVolume) Migrating() bool {
	return v.Spec.MigrationNodeID != "" || v.Status.CurrentMigrationNodeID != ""
}

func conditionDetail(c LonghornCondition) string {
	switch {
	case c.Reason != "" && c.Message != "":
		return " (" + c.Reason + ": " + c.Message + ")"
	case c.Reason+c.Message != "":
		return " (" + c.Reason + c.Message + ")"
	}
	return ""
}

func fromUnstructured(u *unstructured.Unstructured, out any) error {
	return runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out)
}
