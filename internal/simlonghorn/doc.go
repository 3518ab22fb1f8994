// Package simlonghorn is a test-kit stand-in for Longhorn on the simulated
// Harvester host: a longhorn-manager-like controller loop over Longhorn's
// Volume and VolumeAttachment objects on the host API server, and the CSI
// identity, controller and node services of driver.longhorn.io over gRPC.
//
// It follows longhorn-manager v1.10.1 (the Longhorn of Harvester 1.6-1.8):
// ControllerPublish adds an attachment ticket and polls for it to be
// satisfied for up to 90 s (csi/controller_server.go), the VolumeAttachment
// controller detaches an RWO volume before attaching it elsewhere and
// migrates a migratable one with its confirm and rollback rules
// (controller/volume_attachment_controller.go), and NodePublish checks the
// volume's workloads list (csi/node_server.go), which lags pod events as the
// kubernetes PV controller does. Stage durations are real ones times
// Options.Scale, jittered.
//
// The Go types are this package's own, with longhorn-manager's group,
// version and JSON field names: importing
// github.com/longhorn/longhorn-manager/k8s/pkg/apis/longhorn/v1beta2 would
// raise this module's k8s.io/apimachinery and k8s.io/api to v0.34 (what
// longhorn-manager v1.10.1 requires) against the v0.33 that kubevirt.io
// v1.7.0 and the rest of the module build with, and add longhorn-manager's
// module graph for a few structs.
package simlonghorn
