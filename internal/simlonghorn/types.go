package simlonghorn

import (
	"context"

	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// Group and version of longhorn-manager's CRDs (longhorn-manager v1.10.1
// k8s/pkg/apis/longhorn/v1beta2/register.go).
const (
	Group   = "longhorn.io"
	Version = "v1beta2"
	// DriverName is Longhorn's CSI driver name.
	DriverName = "driver.longhorn.io"
)

var (
	volumeGVR = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "volumes"}
	vaGVR     = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "volumeattachments"}
)

// The types below carry the subset of longhorn-manager v1.10.1
// k8s/pkg/apis/longhorn/v1beta2 (volume.go, volumeattachment.go) that the
// attach path reads and writes, under the same JSON names.

// VolumeState is Volume.Status.State.
type VolumeState string

// Volume states (v1beta2/volume.go:10-15).
const (
	VolumeStateCreating  VolumeState = "creating"
	VolumeStateAttached  VolumeState = "attached"
	VolumeStateDetached  VolumeState = "detached"
	VolumeStateAttaching VolumeState = "attaching"
	VolumeStateDetaching VolumeState = "detaching"
)

// VolumeRobustness is Volume.Status.Robustness.
type VolumeRobustness string

// Robustness values (v1beta2/volume.go:21-24).
const (
	VolumeRobustnessHealthy VolumeRobustness = "healthy"
	VolumeRobustnessFaulted VolumeRobustness = "faulted"
	VolumeRobustnessUnknown VolumeRobustness = "unknown"
)

// AccessMode is Volume.Spec.AccessMode.
type AccessMode string

// Access modes.
const (
	AccessModeReadWriteOnce AccessMode = "rwo"
	AccessModeReadWriteMany AccessMode = "rwx"
)

// Volume is longhorn.io/v1beta2 Volume.
type Volume struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              VolumeSpec   `json:"spec,omitempty"`
	Status            VolumeStatus `json:"status,omitempty"`
}

// VolumeSpec is the desired state; the VolumeAttachment controller writes
// NodeID and MigrationNodeID.
type VolumeSpec struct {
	Size             int64      `json:"size,string"`
	Frontend         string     `json:"frontend"`
	NodeID           string     `json:"nodeID"`
	MigrationNodeID  string     `json:"migrationNodeID"`
	AccessMode       AccessMode `json:"accessMode"`
	Migratable       bool       `json:"migratable"`
	NumberOfReplicas int        `json:"numberOfReplicas"`
}

// VolumeStatus is the observed state.
type VolumeStatus struct {
	State                  VolumeState      `json:"state"`
	Robustness             VolumeRobustness `json:"robustness"`
	CurrentNodeID          string           `json:"currentNodeID"`
	CurrentMigrationNodeID string           `json:"currentMigrationNodeID"`
	KubernetesStatus       KubernetesStatus `json:"kubernetesStatus"`
}

// KubernetesStatus ties a Longhorn volume to its PV, PVC and the pods using
// it.
type KubernetesStatus struct {
	PVName          string           `json:"pvName"`
	Namespace       string           `json:"namespace"`
	PVCName         string           `json:"pvcName"`
	WorkloadsStatus []WorkloadStatus `json:"workloadsStatus"`
	LastPodRefAt    string           `json:"lastPodRefAt"`
}

// WorkloadStatus is one pod of KubernetesStatus.WorkloadsStatus.
type WorkloadStatus struct {
	PodName      string `json:"podName"`
	PodStatus    string `json:"podStatus"`
	WorkloadName string `json:"workloadName"`
	WorkloadType string `json:"workloadType"`
}

// AttacherType names who asked for an attachment.
type AttacherType string

// AttacherTypeCSIAttacher is the type of the tickets ControllerPublish adds.
const AttacherTypeCSIAttacher AttacherType = "csi-attacher"

// AttachmentTicket is one request to have the volume attached on a node.
type AttachmentTicket struct {
	ID         string            `json:"id"`
	Type       AttacherType      `json:"type"`
	NodeID     string            `json:"nodeID"`
	Parameters map[string]string `json:"parameters"`
	Generation int64             `json:"generation"`
}

// Condition is a status condition of a ticket.
type Condition struct {
	Type    string `json:"type"`
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

// AttachmentTicketStatus says whether a ticket is satisfied.
type AttachmentTicketStatus struct {
	ID         string      `json:"id"`
	Satisfied  bool        `json:"satisfied"`
	Conditions []Condition `json:"conditions"`
	Generation int64       `json:"generation"`
}

// VolumeAttachment is longhorn.io/v1beta2 VolumeAttachment, one per volume.
type VolumeAttachment struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              VolumeAttachmentSpec   `json:"spec,omitempty"`
	Status            VolumeAttachmentStatus `json:"status,omitempty"`
}

// VolumeAttachmentSpec holds the tickets.
type VolumeAttachmentSpec struct {
	AttachmentTickets map[string]*AttachmentTicket `json:"attachmentTickets"`
	Volume            string                       `json:"volume"`
}

// VolumeAttachmentStatus holds the tickets' statuses.
type VolumeAttachmentStatus struct {
	AttachmentTicketStatuses map[string]*AttachmentTicketStatus `json:"attachmentTicketStatuses"`
}

// satisfied is v1beta2.IsAttachmentTicketSatisfied: the status must be of
// the ticket's generation.
func (va *VolumeAttachment) satisfied(id string) bool {
	t, ok := va.Spec.AttachmentTickets[id]
	if !ok {
		return false
	}
	st, ok := va.Status.AttachmentTicketStatuses[id]
	return ok && st.Generation == t.Generation && st.Satisfied
}

// Satisfied reports whether ticket id is satisfied at its generation.
func (va *VolumeAttachment) Satisfied(id string) bool { return va.satisfied(id) }

func crd(plural, singular, kind string, shortNames []string) *apiextv1.CustomResourceDefinition {
	return &apiextv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: plural + "." + Group},
		Spec: apiextv1.CustomResourceDefinitionSpec{
			Group: Group,
			Names: apiextv1.CustomResourceDefinitionNames{
				Plural: plural, Singular: singular, Kind: kind, ListKind: kind + "List", ShortNames: shortNames,
			},
			Scope: apiextv1.NamespaceScoped,
			Versions: []apiextv1.CustomResourceDefinitionVersion{{
				Name: Version, Served: true, Storage: true,
				// Open schemas: the stand-in writes only the fields above,
				// and an open schema keeps clients that write more
				// (longhorn-manager's own) working.
				Schema: &apiextv1.CustomResourceValidation{OpenAPIV3Schema: &apiextv1.JSONSchemaProps{
					Type: "object", XPreserveUnknownFields: ptr.To(true),
				}},
				Subresources: &apiextv1.CustomResourceSubresources{Status: &apiextv1.CustomResourceSubresourceStatus{}},
			}},
		},
	}
}

// InstallCRDs creates the Volume and VolumeAttachment CRDs (names, short
// names, scope and status subresource as longhorn v1.10.1's chart) when
// missing and waits until they are served.
func InstallCRDs(ctx context.Context, cfg *rest.Config) error {
	ext, err := apiextclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	list := []*apiextv1.CustomResourceDefinition{
		crd("volumes", "volume", "Volume", []string{"lhv"}),
		crd("volumeattachments", "volumeattachment", "VolumeAttachment", []string{"lhva"}),
	}
	return testenv.InstallCRDs(ctx, ext, list)
}
